// The official `openai` npm client against a running `bitdelta serve`:
//   node tests/node/openai_client.mjs http://127.0.0.1:PORT/v1 [API_KEY]
// Completions (n > 1 and a list of prompts too) and chat, whole and streamed, model listing and a
// 404; exits non-zero on any mismatch.
import assert from "node:assert/strict";
import OpenAI from "openai";

const [baseURL, apiKey = "none"] = process.argv.slice(2);
if (!baseURL) {
  console.error("usage: node openai_client.mjs BASE_URL [API_KEY]");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60_000 });

const models = await client.models.list();
const ids = models.data.map((m) => m.id);
assert.ok(ids.includes("base"), `models: ${ids}`);
const variant = ids.find((id) => id !== "base") ?? "base";
assert.equal((await client.models.retrieve(variant)).id, variant);

const params = { model: variant, prompt: "the quick brown fox", max_tokens: 8, temperature: 0, seed: 1 };
const whole = await client.completions.create({ ...params, ignore_eos: true });
assert.equal(whole.object, "text_completion");
assert.equal(whole.usage.completion_tokens, 8);
let streamed = "";
let usage = null;
const stream = await client.completions.create({
  ...params, ignore_eos: true, stream: true, stream_options: { include_usage: true },
});
for await (const chunk of stream) {
  if (chunk.choices.length) streamed += chunk.choices[0].text;
  if (chunk.usage) usage = chunk.usage;
}
assert.equal(streamed, whole.choices[0].text);
assert.equal(usage?.completion_tokens, 8);

// n choices of one prompt, and a list of prompts: one choice per prompt and n, indexed in order.
const two = await client.completions.create({
  ...params, prompt: ["the quick brown fox", "the lazy dog"], n: 2, temperature: 0.8, max_tokens: 4,
  ignore_eos: true,
});
assert.deepEqual(two.choices.map((c) => c.index), [0, 1, 2, 3]);
assert.equal(two.usage.completion_tokens, 16);

const messages = [{ role: "user", content: "Write a short poem about the sea." }];
const chat = await client.chat.completions.create({ model: variant, messages, max_tokens: 6, temperature: 0 });
assert.equal(chat.object, "chat.completion");
assert.equal(chat.choices[0].message.role, "assistant");
let chatStreamed = "";
const chatStream = await client.chat.completions.create({
  model: variant, messages, max_tokens: 6, temperature: 0, stream: true,
});
for await (const chunk of chatStream) chatStreamed += chunk.choices[0]?.delta?.content ?? "";
assert.equal(chatStreamed, chat.choices[0].message.content);

const withLogprobs = await client.chat.completions.create({
  model: "base", messages, max_tokens: 3, temperature: 0, logprobs: true, top_logprobs: 2,
});
assert.equal(withLogprobs.choices[0].logprobs.content.length, withLogprobs.usage.completion_tokens);

await assert.rejects(
  client.completions.create({ ...params, model: "no-such-model" }),
  (e) => e instanceof OpenAI.NotFoundError && e.status === 404,
);
await assert.rejects(
  client.completions.create({ ...params, temperature: -1 }),
  (e) => e instanceof OpenAI.BadRequestError && /temperature/.test(e.message),
);
console.log("openai client: all checks passed");
