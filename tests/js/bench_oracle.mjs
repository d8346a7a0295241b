// Timing for bench/test_workflow.py: how long GitHub's own TypeScript
// implementations take for the same work, measured inside node.
// stdin: {"kind": "expressions", "exprs": [...], "context": {...}, "repeat": N}
//     or {"kind": "workflow", "content": "...", "repeat": N}
// stdout: {"seconds_per_repeat": s}
import { register } from "node:module";

register("./json_hooks.mjs", import.meta.url);
const { Evaluator, Lexer, Parser } = await import("@actions/expressions");
const { reviver } = await import("@actions/expressions/data/reviver");
const { NoOperationTraceWriter, convertWorkflowTemplate, parseWorkflow } = await import(
  "@actions/workflow-parser"
);

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const input = JSON.parse(Buffer.concat(chunks).toString("utf8"));

async function once() {
  if (input.kind === "expressions") {
    const ctx = JSON.parse(JSON.stringify(input.context), reviver);
    const names = ctx.pairs().map(p => p.key);
    for (const expr of input.exprs) {
      const tree = new Parser(new Lexer(expr).lex().tokens, names, []).parse();
      new Evaluator(tree, ctx).evaluate();
    }
  } else {
    const file = { name: ".github/workflows/w.yml", content: input.content };
    const parsed = parseWorkflow(file, new NoOperationTraceWriter());
    await convertWorkflowTemplate(parsed.context, parsed.value);
  }
}

await once(); // warm-up
const start = process.hrtime.bigint();
for (let i = 0; i < input.repeat; i++) await once();
const seconds = Number(process.hrtime.bigint() - start) / 1e9;
process.stdout.write(JSON.stringify({ seconds_per_repeat: seconds / input.repeat }));
