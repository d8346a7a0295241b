// Downloads with @actions/artifact as download-artifact@v4 does: by name, and
// `pattern` + `merge-multiple` (list, filter, download each into one directory).
const {DefaultArtifactClient} = require('@actions/artifact');

async function main() {
  const client = new DefaultArtifactClient();
  const [mode, dest] = process.argv.slice(2);
  const {artifacts} = await client.listArtifacts();
  console.log(`listed ${artifacts.map(a => a.name).sort().join(',')}`);
  if (mode === 'pattern') {
    const re = new RegExp(process.argv[4]);
    for (const a of artifacts.filter(a => re.test(a.name))) {
      await client.downloadArtifact(a.id, {path: dest});
      console.log(`downloaded ${a.name}`);
    }
  } else {
    for (const name of mode.split(',')) {
      const {artifact} = await client.getArtifact(name);
      const r = await client.downloadArtifact(artifact.id, {path: `${dest}/${name}`});
      console.log(`downloaded ${name} digestMismatch=${r.digestMismatch}`);
    }
  }
}

main().catch(e => {
  console.error(`ERROR ${e.stack || e}`);
  process.exit(1);
});
