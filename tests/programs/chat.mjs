// A program agent in JavaScript, no SDK: the task from stdin (and the file named by
// AGENTARIUM_TASK_FILE), one chat completion through the rollout's gateway (OPENAI_BASE_URL,
// OPENAI_API_KEY), then what it saw and, last, its reward as a JSON line.
import { readFileSync } from "node:fs";

const task = JSON.parse(readFileSync(0, "utf8"));
const fromFile = JSON.parse(readFileSync(process.env.AGENTARIUM_TASK_FILE, "utf8"));
const response = await fetch(`${process.env.OPENAI_BASE_URL}/chat/completions`, {
  method: "POST",
  headers: {
    "content-type": "application/json",
    authorization: `Bearer ${process.env.OPENAI_API_KEY}`,
  },
  body: JSON.stringify({
    model: process.env.AGENTARIUM_MODEL,
    messages: [{ role: "user", content: task.prompt }],
    max_tokens: 8,
  }),
});
if (!response.ok) {
  console.error(`HTTP ${response.status}: ${await response.text()}`);
  process.exit(1);
}
const reply = (await response.json()).choices[0].message.content;
console.error(`asked ${process.env.OPENAI_BASE_URL}`); // the consumer masks the secret in it
console.log(
  JSON.stringify({
    reply,
    uid: process.getuid(),
    cwd: process.cwd(),
    home: process.env.HOME,
    env: Object.keys(process.env).sort(),
    same_task: JSON.stringify(task) === JSON.stringify(fromFile),
  }),
);
// characters as Python counts them (code points): .length counts UTF-16 units, 2 for one above U+FFFF
console.log(JSON.stringify({ reward: reply.trim() === task.answer ? 1 : 0, metrics: { reply_chars: [...reply].length } }));
