// The TypeScript MCP SDK's client against one episode of the counter environment.
// Usage: node client.mjs http|sse URL   Prints one JSON object: what each step saw.
import { readFileSync } from "node:fs";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { SSEClientTransport } from "@modelcontextprotocol/sdk/client/sse.js";

const [transportName, url] = process.argv.slice(2);
const transport = transportName === "sse"
  ? new SSEClientTransport(new URL(url))
  : new StreamableHTTPClientTransport(new URL(url));
const client = new Client({ name: "envscaler-interop", version: "1" });
await client.connect(transport);

const text = (result) => result.content.map((part) => part.text).join("");
const listed = await client.listTools();
const read = await client.callTool({ name: "get_item", arguments: { item_id: "a" } });
const write = await client.callTool({ name: "add", arguments: { item_id: "a", amount: 3 } });
const invalid = await client.callTool({ name: "add", arguments: { item_id: 7 } });
const refused = await client.callTool({ name: "get_item", arguments: { item_id: "nope" } });
await client.close();

console.log(JSON.stringify({
  sdk: JSON.parse(readFileSync(new URL("./node_modules/@modelcontextprotocol/sdk/package.json", import.meta.url))).version,
  protocol: transport.protocolVersion ?? null,
  tools: listed.tools.map((tool) => ({ name: tool.name, readOnly: tool.annotations?.readOnlyHint ?? null })),
  read: { isError: read.isError ?? false, text: text(read) },
  write: { isError: write.isError ?? false, text: text(write) },
  invalid: { isError: invalid.isError ?? false, text: text(invalid) },
  refused: { isError: refused.isError ?? false, text: text(refused) },
}));
