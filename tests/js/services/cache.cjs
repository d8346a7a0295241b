// actions/cache@v4's calls through GitHub's client (@actions/cache).
// argv: ops, each `save:KEY:DIR`, `restore:KEY[,RESTORE_KEY...]:DIR`.
const cache = require('@actions/cache');

async function main() {
  for (const op of process.argv.slice(2)) {
    const [kind, keys, dir] = op.split(':');
    if (kind === 'save') {
      const id = await cache.saveCache([dir], keys);
      console.log(`save ${keys} -> ${id}`);
    } else {
      const [key, ...restore] = keys.split(',');
      const hit = await cache.restoreCache([dir], key, restore);
      console.log(`restore ${keys} -> ${hit === undefined ? 'miss' : hit}`);
    }
  }
}

main().catch(e => {
  console.error(`ERROR ${e.stack || e}`);
  process.exit(1);
});
