// Oracle for tests/test_expressions_differential.py: evaluates a batch of
// expressions with GitHub's @actions/expressions and prints one JSON document.
// stdin: {"cases": [{"expr": "...", "context": <index>}], "contexts": [<json>...]}
// stdout: [{"ok": true, "value": <tagged>} | {"ok": false, "error": "..."}]
import { Evaluator, Lexer, Parser, data } from "@actions/expressions";
import { reviver } from "@actions/expressions/data/reviver";

// A tagged, order-preserving rendering of an expression value, so JavaScript
// object key order and number formatting cannot hide a difference.
function tag(v) {
  switch (v.kind) {
    case data.Kind.Null: return { t: "null" };
    case data.Kind.Boolean: return { t: "bool", v: v.value };
    case data.Kind.Number: return { t: "num", v: String(v.value) };
    case data.Kind.String: return { t: "str", v: v.value };
    case data.Kind.Array: return { t: "arr", v: v.values().map(tag) };
    case data.Kind.Dictionary: return { t: "obj", v: v.pairs().map(p => [p.key, tag(p.value)]) };
  }
  return { t: "unknown" };
}

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const input = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const contexts = input.contexts.map(c => JSON.parse(JSON.stringify(c), reviver));
const out = [];
for (const { expr, context } of input.cases) {
  const ctx = contexts[context];
  const names = ctx.pairs().map(p => p.key);
  try {
    const lexer = new Lexer(expr);
    const tree = new Parser(lexer.lex().tokens, names, []).parse();
    const value = new Evaluator(tree, ctx).evaluate();
    out.push({ ok: true, value: tag(value) });
  } catch (e) {
    out.push({ ok: false, error: String(e && e.message) });
  }
}
process.stdout.write(JSON.stringify(out));
