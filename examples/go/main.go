// Command agentarium-go: publish Agentarium jobs and read their trajectories back, in Go,
// with nothing but a NATS client (github.com/nats-io/nats.go).
//
// Jobs are JSON on agentarium.tasks.<agent> (Nats-Msg-Id = job id, so a republished job is a
// duplicate). Trajectories are read from agentarium.trajectories.<run>.<agent>.<job_id>; each
// says its encoding in its Content-Type header, and this program asks for JSON: run the
// consumer with --encoding json (msgpack trajectories carry token ids as packed int32 bytes,
// which need a msgpack library; the JSON Schemas in schemas/json/ describe both).
//
// It prints one JSON line per trajectory and exits 0 once every job has one, 1 on a
// timeout or an unreadable trajectory.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
)

// Job holds the three required fields of schemas/json/job.schema.json, and the run.
type Job struct {
	JobID string         `json:"job_id"`
	Agent string         `json:"agent"`
	Run   string         `json:"run"`
	Task  map[string]any `json:"task"`
}

// LLMCall is the part of one call this example reads; null logprobs (non-finite) stay nil.
type LLMCall struct {
	PromptIDs        []int32    `json:"prompt_ids"`
	ResponseIDs      []int32    `json:"response_ids"`
	ResponseLogprobs []*float64 `json:"response_logprobs"`
	FinishReason     string     `json:"finish_reason"`
}

// Trajectory is the part of schemas/json/trajectory.schema.json this example reads.
type Trajectory struct {
	JobID  string    `json:"job_id"`
	Agent  string    `json:"agent"`
	Run    string    `json:"run"`
	Status string    `json:"status"`
	Reward *float64  `json:"reward"`
	Error  *string   `json:"error"`
	Calls  []LLMCall `json:"calls"`
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "agentarium-go: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	url := flag.String("nats", nats.DefaultURL, "NATS server URL")
	agent := flag.String("agent", "toy", "agent whose consumer runs the jobs")
	run := flag.String("run", "go-example", "run id: the trajectories' subject token")
	prefix := flag.String("prefix", "agentarium", "subject prefix")
	jobs := flag.Int("jobs", 3, "jobs to publish")
	timeout := flag.Duration("timeout", 2*time.Minute, "how long to wait for the trajectories")
	flag.Parse()

	nc, err := nats.Connect(*url)
	if err != nil {
		fail("cannot connect to %s: %v", *url, err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		fail("no JetStream: %v", err)
	}

	// Subscribe before publishing; an ordered consumer reads the stream from its start, and
	// only this invocation's job ids count.
	filter := fmt.Sprintf("%s.trajectories.%s.%s.*", *prefix, *run, *agent)
	sub, err := js.SubscribeSync(filter, nats.OrderedConsumer())
	if err != nil {
		fail("cannot read %s: %v (has `agentarium broker init` run?)", filter, err)
	}

	wanted := map[string]bool{}
	stamp := time.Now().UnixNano()
	for i := 0; i < *jobs; i++ {
		digit := fmt.Sprint(i % 10)
		job := Job{
			JobID: fmt.Sprintf("go-%d-%d", stamp, i),
			Agent: *agent,
			Run:   *run,
			Task:  map[string]any{"prompt": "repeat " + digit, "answer": digit},
		}
		data, err := json.Marshal(job)
		if err != nil {
			fail("cannot encode job: %v", err)
		}
		msg := nats.NewMsg(*prefix + ".tasks." + *agent)
		msg.Data = data
		msg.Header.Set("Content-Type", "application/json")
		msg.Header.Set("Nats-Msg-Id", job.JobID)
		if _, err := js.PublishMsg(msg); err != nil {
			fail("publish %s: %v", job.JobID, err)
		}
		wanted[job.JobID] = true
	}
	fmt.Printf("{\"published\": %d}\n", len(wanted))

	deadline := time.Now().Add(*timeout)
	for len(wanted) > 0 {
		msg, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			fail("%d trajectories missing after %s: %v (is a consumer for %q running?)",
				len(wanted), *timeout, err, *agent)
		}
		if ct := msg.Header.Get("Content-Type"); ct != "application/json" {
			fail("%s is %q, not application/json: run the consumer with --encoding json",
				msg.Subject, ct)
		}
		var t Trajectory
		if err := json.Unmarshal(msg.Data, &t); err != nil {
			fail("%s: not a trajectory: %v", msg.Subject, err)
		}
		if !wanted[t.JobID] {
			continue // an earlier invocation's
		}
		delete(wanted, t.JobID)
		line, _ := json.Marshal(t)
		fmt.Println(string(line))
	}
}
