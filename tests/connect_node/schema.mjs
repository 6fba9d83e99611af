// Loads llmgw.v1 descriptors from a FileDescriptorSet built at test time (protoc
// --descriptor_set_out --include_imports): no JavaScript code generation.
import { readFileSync } from "node:fs";
import { createFileRegistry, fromBinary } from "@bufbuild/protobuf";
import { FileDescriptorSetSchema } from "@bufbuild/protobuf/wkt";

export function loadAgentSchema(descriptorSetPath) {
  const registry = createFileRegistry(
    fromBinary(FileDescriptorSetSchema, readFileSync(descriptorSetPath)),
  );
  const need = (what, desc) => {
    if (desc === undefined) throw new Error(`${what} not found in ${descriptorSetPath}`);
    return desc;
  };
  return {
    AgentService: need("service", registry.getService("llmgw.v1.AgentService")),
    AgentMessage: need("message", registry.getMessage("llmgw.v1.AgentMessage")),
    ControlMessage: need("message", registry.getMessage("llmgw.v1.ControlMessage")),
  };
}

// Exits with `code` once the JSON line is written (stdout to a pipe must not be cut short).
export function finish(summary, code) {
  process.stdout.write(`${JSON.stringify(summary)}\n`, () => process.exit(code));
}
