// connect-node server for llmgw's client: Connect protocol only, h2c on 127.0.0.1, kernel-chosen port.
//
// argv[2] is the FileDescriptorSet path. The first stdout line is the port. Behaviour:
// - every message but the one below: answered with an Ack naming its message_id;
// - Register(node_id="refuse", hostname=TEXT): the call fails with PermissionDenied and TEXT.
// Exits on SIGTERM, or when stdin closes (the test that started it is gone).
import http2 from "node:http2";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { loadAgentSchema } from "./schema.mjs";

const { AgentService, ControlMessage } = loadAgentSchema(process.argv[2]);

const ack = (messageId) =>
  create(ControlMessage, { messageId, msg: { case: "ack", value: { messageId, ok: true } } });

const handler = connectNodeAdapter({
  grpc: false, // only the Connect protocol: a client speaking anything else is turned away
  grpcWeb: false,
  routes: (router) =>
    router.service(AgentService, {
      async *connect(requests) {
        for await (const msg of requests) {
          if (msg.msg.case === "register" && msg.msg.value.nodeId === "refuse") {
            throw new ConnectError(msg.msg.value.hostname, Code.PermissionDenied);
          }
          yield ack(msg.messageId);
        }
      },
    }),
});

const server = http2.createServer(handler);
process.on("SIGTERM", () => process.exit(0));
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
server.listen(0, "127.0.0.1", () => {
  process.stdout.write(`${server.address().port}\n`);
});
