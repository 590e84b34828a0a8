// A program agent acting in an environment session, through the bridge at AGENTARIUM_ENV_URL:
// it reads the opening observation, runs the task's reference SQL with the sql environment's
// execute_sql tool, commits the rows it got back, and prints what it saw. The session scores it.
import { readFileSync } from "node:fs";

const task = JSON.parse(readFileSync(0, "utf8"));
const url = process.env.AGENTARIUM_ENV_URL;
const call = (name, args) => ({
  role: "assistant",
  content: "",
  tool_calls: [{ id: `call-${name}`, type: "function", function: { name, arguments: JSON.stringify(args) } }],
});
const step = async (message) => {
  const response = await fetch(`${url}/step`, { method: "POST", body: JSON.stringify(message) });
  if (!response.ok) throw new Error(`step: HTTP ${response.status} ${await response.text()}`);
  return response.json();
};

const observation = await (await fetch(`${url}/observation`)).json();
const ran = await step(call("execute_sql", { query: task.sql }));
const text = ran.messages.map((m) => m.content).join("\n");
const rows = [...text.matchAll(/\('((?:[^'\\]|\\.)*)',\)|\((-?[\d.]+),\)/g)].map((m) => m[1] ?? m[2]);
const committed = await step(call("commit_final_answer", { answer: rows }));
console.log(JSON.stringify({ tools: observation.tools.map((t) => t.function.name), rows, done: committed.done }));
