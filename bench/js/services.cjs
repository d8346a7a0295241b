// bench/test_services.py: one round trip through preloop's services with GitHub's clients.
// artifact SRC DEST LEVEL: upload SRC as an artifact, download it into DEST.
// cache SRC KEY: save SRC under KEY, remove SRC, restore it.
const fs = require('fs');
const path = require('path');

function walk(dir) {
  const out = [];
  for (const e of fs.readdirSync(dir, {withFileTypes: true})) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) out.push(...walk(p));
    else out.push(p);
  }
  return out;
}

async function main() {
  const [mode, ...args] = process.argv.slice(2);
  if (mode === 'artifact') {
    const {DefaultArtifactClient} = require('@actions/artifact');
    const [src, dest, level] = args;
    const client = new DefaultArtifactClient();
    const {id} = await client.uploadArtifact('bench', walk(src), src, {compressionLevel: +level});
    await client.downloadArtifact(id, {path: dest});
  } else {
    const cache = require('@actions/cache');
    const [src, key] = args;
    const saved = await cache.saveCache([src], key);
    if (saved < 0) throw new Error('save failed');
    fs.rmSync(src, {recursive: true});
    const hit = await cache.restoreCache([src], key);
    if (hit !== key) throw new Error('restore missed');
  }
}

main().catch(e => {
  console.error(e);
  process.exit(1);
});
