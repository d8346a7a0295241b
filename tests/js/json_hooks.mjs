// Node module hooks: @actions/workflow-parser imports its JSON schema without
// an import attribute (it is written for bundlers); node 20 requires one.
export async function load(url, context, nextLoad) {
  if (url.endsWith(".json")) {
    return nextLoad(url, { ...context, importAttributes: { type: "json" } });
  }
  return nextLoad(url, context);
}
