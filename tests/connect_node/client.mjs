// connect-node client -> llmgw server, Connect protocol (binary) over h2c.
//
// argv[2] is a JSON config: {descriptorSet, baseUrl, heartbeats, push, bigBytes, refuseText}.
// Prints one JSON summary line on stdout; exits 0 only if every check passed.
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-node";
import { finish, loadAgentSchema } from "./schema.mjs";

const cfg = JSON.parse(process.argv[2]);
const { AgentService, AgentMessage } = loadAgentSchema(cfg.descriptorSet);

// An open-ended request stream: messages are pushed while responses are read.
class Outbox {
  #items = [];
  #waiters = [];
  #closed = false;
  get closed() {
    return this.#closed;
  }
  push(value) {
    if (this.#closed) throw new Error("push after close");
    this.#items.push(value);
    this.#wake();
  }
  close() {
    this.#closed = true;
    this.#wake();
  }
  #wake() {
    for (const wake of this.#waiters.splice(0)) wake();
  }
  async *[Symbol.asyncIterator]() {
    for (;;) {
      if (this.#items.length) yield this.#items.shift();
      else if (this.#closed) return;
      else await new Promise((resolve) => this.#waiters.push(resolve));
    }
  }
}

const heartbeat = (id) =>
  create(AgentMessage, { messageId: BigInt(id), msg: { case: "heartbeat", value: { nodeId: "echo" } } });
const register = (id, fields) =>
  create(AgentMessage, { messageId: BigInt(id), msg: { case: "register", value: fields } });

const summary = { failures: [] };
const check = (ok, what) => {
  if (!ok) summary.failures.push(what);
  return ok;
};

// Whatever happens, answer within the deadline with what was learnt so far.
setTimeout(() => {
  summary.failures.push("watchdog: client did not finish in time");
  finish(summary, 3);
}, cfg.watchdogMs ?? 25000).unref();

async function nextAck(responses, what) {
  const r = await responses.next();
  if (r.done) throw new Error(`${what}: response stream ended early`);
  if (r.value.msg.case !== "ack") throw new Error(`${what}: expected an ack, got ${r.value.msg.case}`);
  return r.value.msg.value;
}

const transport = createConnectTransport({ baseUrl: cfg.baseUrl, httpVersion: "2", useBinaryFormat: true });
const client = createClient(AgentService, transport);

async function mainStream() {
  const outbox = new Outbox();
  const responses = client.connect(outbox, { timeoutMs: 20000 })[Symbol.asyncIterator]();

  // 1. Pipelined: every heartbeat is queued before the first ack is read.
  for (let i = 0; i < cfg.heartbeats; i++) outbox.push(heartbeat(i));
  const acked = [];
  for (let i = 0; i < cfg.heartbeats; i++) acked.push(Number((await nextAck(responses, "heartbeat")).messageId));
  summary.heartbeats = {
    sent: cfg.heartbeats,
    acked: acked.length,
    inOrder: acked.every((id, i) => id === i),
  };
  check(summary.heartbeats.inOrder, "heartbeat acks out of order");

  // 2. Server push while the request side stays open.
  outbox.push(register(cfg.heartbeats, { nodeId: "push", cpuCount: cfg.push }));
  const pushed = [];
  for (let i = 0; i < cfg.push; i++) pushed.push(Number((await nextAck(responses, "push")).messageId));
  summary.push = {
    received: pushed.length,
    inOrder: pushed.every((id, i) => id === i),
    requestSideOpen: !outbox.closed,
  };
  check(summary.push.inOrder && summary.push.requestSideOpen, "pushed acks wrong");

  // 3. 1 MiB each way: a 1 MiB Register up, a 1 MiB Ack down.
  const bigId = cfg.heartbeats + 1;
  outbox.push(
    register(bigId, { nodeId: "big", cpuCount: cfg.bigBytes, hostname: "h".repeat(cfg.bigBytes) }),
  );
  const big = await nextAck(responses, "big");
  summary.big = {
    messageId: Number(big.messageId),
    errorLength: big.error.length,
    allX: /^x*$/.test(big.error),
  };
  check(summary.big.errorLength === cfg.bigBytes && summary.big.allX, "big ack wrong");

  // 4. Half-close: the server ends the stream with OK.
  outbox.close();
  const end = await responses.next();
  summary.cleanEnd = end.done === true;
  check(summary.cleanEnd, "stream did not end after half-close");
}

async function refusedStream() {
  const outbox = new Outbox();
  outbox.push(register(1, { nodeId: "refuse", hostname: cfg.refuseText }));
  const unexpected = [];
  try {
    for await (const msg of client.connect(outbox, { timeoutMs: 20000 })) unexpected.push(msg.msg.case);
    summary.refuse = { error: null, unexpected };
  } catch (e) {
    const err = ConnectError.from(e);
    summary.refuse = { code: err.code, codeName: Code[err.code], rawMessage: err.rawMessage, unexpected };
  } finally {
    outbox.close();
  }
  check(
    summary.refuse.code === Code.PermissionDenied && summary.refuse.rawMessage === cfg.refuseText,
    "refuse: expected PermissionDenied with the exact message",
  );
}

try {
  await mainStream();
} catch (e) {
  const err = ConnectError.from(e);
  summary.failures.push(`main stream: [${Code[err.code]}] ${err.rawMessage}`);
}
try {
  await refusedStream();
} catch (e) {
  summary.failures.push(`refuse stream: ${e}`);
}
finish(summary, summary.failures.length ? 1 : 0);
