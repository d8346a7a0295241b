// Oracle for tests/test_workflow_differential.py: parses a batch of workflow
// files with GitHub's @actions/workflow-parser and prints their errors.
// stdin: [{"name": "x.yml", "content": "..."}]
// stdout: [[{"message": "...", "line": 1, "column": 1}, ...], ...]  (1-based)
import { register } from "node:module";

register("./json_hooks.mjs", import.meta.url);
const { NoOperationTraceWriter, convertWorkflowTemplate, parseWorkflow } = await import(
  "@actions/workflow-parser"
);

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const files = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const out = [];
for (const file of files) {
  const parsed = parseWorkflow(file, new NoOperationTraceWriter());
  if (parsed.value !== undefined) {
    await convertWorkflowTemplate(parsed.context, parsed.value);
  }
  out.push(
    parsed.context.errors.getErrors().map(e => ({
      message: e.rawMessage ?? e.message,
      line: e.range ? e.range.start.line : null,
      column: e.range ? e.range.start.column : null
    }))
  );
}
process.stdout.write(JSON.stringify(out));
