// Publish Agentarium jobs and read their trajectories back, in Node.js, with nothing but the
// NATS client (@nats-io/transport-node, @nats-io/jetstream).
//
//   node examples/node/agentarium.mjs [--nats URL] [--agent toy] [--run node-example]
//                                     [--prefix agentarium] [--jobs 3] [--timeout-s 120]
//
// Jobs are JSON on <prefix>.tasks.<agent> (Nats-Msg-Id = job id, so a republished job is a
// duplicate). Trajectories are read from <prefix>.trajectories.<run>.<agent>.<job_id>; each
// says its encoding in its Content-Type header, and this program asks for JSON: run the
// consumer with --encoding json (msgpack trajectories carry token ids as packed int32 bytes,
// which need a msgpack library; the JSON Schemas in schemas/json/ describe both).
//
// It prints one JSON line per trajectory and exits 0 once every job has one, 1 on a timeout
// or an unreadable trajectory.
import { parseArgs } from "node:util";
import { connect, headers } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";

const { values: opts } = parseArgs({
  options: {
    nats: { type: "string", default: "nats://127.0.0.1:4222" },
    agent: { type: "string", default: "toy" },
    run: { type: "string", default: "node-example" },
    prefix: { type: "string", default: "agentarium" },
    jobs: { type: "string", default: "3" },
    "timeout-s": { type: "string", default: "120" },
  },
});

function fail(message) {
  console.error(`agentarium-node: ${message}`);
  process.exit(1);
}

const nc = await connect({ servers: opts.nats }).catch((err) =>
  fail(`cannot connect to ${opts.nats}: ${err.message}`),
);
const js = jetstream(nc);

// An ordered consumer on the run's trajectories, made before publishing; it reads the stream
// from its start, and only this invocation's job ids count.
const filter = `${opts.prefix}.trajectories.${opts.run}.${opts.agent}.*`;
const jsm = await jetstreamManager(nc);
const stream = await jsm.streams
  .find(filter)
  .catch((err) => fail(`no stream holds ${filter}: ${err.message} (has \`agentarium broker init\` run?)`));
// One filter as a string: a list needs nats-server 2.10 (Debian 12 ships 2.9).
const consumer = await js.consumers.get(stream, { filter_subjects: filter });

const wanted = new Set();
const stamp = Date.now();
for (let i = 0; i < Number(opts.jobs); i++) {
  const digit = String(i % 10);
  const job = {
    job_id: `node-${stamp}-${i}`,
    agent: opts.agent,
    run: opts.run,
    task: { prompt: `repeat ${digit}`, answer: digit },
  };
  const h = headers();
  h.set("Content-Type", "application/json");
  await js.publish(`${opts.prefix}.tasks.${opts.agent}`, JSON.stringify(job), {
    msgID: job.job_id,
    headers: h,
  });
  wanted.add(job.job_id);
}
console.log(JSON.stringify({ published: wanted.size }));

const deadline = Date.now() + Number(opts["timeout-s"]) * 1000;
while (wanted.size > 0) {
  const left = deadline - Date.now();
  const msg = left > 0 ? await consumer.next({ expires: Math.min(left, 5000) }) : null;
  if (msg === null) {
    if (Date.now() < deadline) continue;
    fail(`${wanted.size} trajectories missing after ${opts["timeout-s"]} s (is a consumer for ${opts.agent} running?)`);
  }
  const contentType = msg.headers?.get("Content-Type");
  if (contentType !== "application/json") {
    fail(`${msg.subject} is ${JSON.stringify(contentType)}, not application/json: run the consumer with --encoding json`);
  }
  let t;
  try {
    t = msg.json();
  } catch (err) {
    fail(`${msg.subject}: not a trajectory: ${err.message}`);
  }
  if (!wanted.has(t.job_id)) continue; // an earlier invocation's
  wanted.delete(t.job_id);
  const calls = t.calls.map((c) => ({
    prompt_ids: c.prompt_ids,
    response_ids: c.response_ids,
    response_logprobs: c.response_logprobs,
    finish_reason: c.finish_reason,
  }));
  console.log(JSON.stringify({ job_id: t.job_id, agent: t.agent, run: t.run, status: t.status, reward: t.reward, error: t.error, calls }));
}
await nc.close();
