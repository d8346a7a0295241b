// Uploads with GitHub's own client (@actions/artifact), as upload-artifact@v4 does.
// argv: modes, run in order; see each case. Prints one line per result for the test to read.
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');
const {DefaultArtifactClient} = require('@actions/artifact');

function walk(dir) {
  const out = [];
  for (const e of fs.readdirSync(dir, {withFileTypes: true})) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) out.push(...walk(p));
    else out.push(p);
  }
  return out.sort();
}

async function upload(client, name, root, options) {
  const r = await client.uploadArtifact(name, walk(root), root, options);
  console.log(`uploaded ${name} id=${r.id} size=${r.size}`);
  return r;
}

async function main() {
  for (const mode of process.argv.slice(2)) await run(mode);
}

async function run(mode) {
  const client = new DefaultArtifactClient();
  const ws = process.env.GITHUB_WORKSPACE;
  if (mode === 'basic') {
    await upload(client, 'data', path.join(ws, 'data'));
    fs.mkdirSync('p1/sub', {recursive: true});
    fs.writeFileSync('p1/sub/one.txt', 'one\n');
    fs.mkdirSync('p2', {recursive: true});
    fs.writeFileSync('p2/two.txt', 'first version\n');
    fs.mkdirSync('o', {recursive: true});
    fs.writeFileSync('o/other.txt', 'other\n');
    await upload(client, 'part-1', 'p1');
    await upload(client, 'part-2', 'p2');
    await upload(client, 'other', 'o');
    try {
      await upload(client, 'part-2', 'p2');
      console.log('duplicate: accepted');
    } catch (e) {
      console.log(`duplicate: refused: ${e.message}`);
    }
    // upload-artifact's `overwrite: true`: delete, then upload again
    fs.writeFileSync('p2/two.txt', 'second version\n');
    await client.deleteArtifact('part-2');
    await upload(client, 'part-2', 'p2');
  } else if (mode.startsWith('dir:')) {
    // dir:NAME:DIR uploads DIR as artifact NAME
    const [, name, dir] = mode.split(':');
    await upload(client, name, dir);
  } else if (mode === 'forged') {
    // the same token with the run changed: the signature no longer matches
    const [h, p, s] = process.env.ACTIONS_RUNTIME_TOKEN.split('.');
    const claims = JSON.parse(Buffer.from(p, 'base64url').toString());
    claims.scp = claims.scp.replace(/Actions\.Results:[^: ]+:/, 'Actions.Results:999:');
    claims.preloop.run = '999';
    const forged = [h, Buffer.from(JSON.stringify(claims)).toString('base64url'), s].join('.');
    process.env.ACTIONS_RUNTIME_TOKEN = forged;
    fs.mkdirSync('f', {recursive: true});
    fs.writeFileSync('f/x.txt', 'x');
    try {
      await upload(client, 'forged', 'f');
      console.log('forged: accepted');
    } catch (e) {
      console.log(`forged: refused: ${e.message}`);
    }
  } else if (mode === 'bulk') {
    fs.mkdirSync('many', {recursive: true});
    for (let i = 0; i < 1000; i++) {
      fs.mkdirSync(`many/d${i % 10}`, {recursive: true});
      fs.writeFileSync(`many/d${i % 10}/f${i}.txt`, `file ${i}\n`.repeat(1 + (i % 7)));
    }
    // 200 MB of incompressible, reproducible bytes (AES-CTR over zeros)
    fs.mkdirSync('big', {recursive: true});
    const cipher = crypto.createCipheriv('aes-128-ctr', Buffer.alloc(16, 7), Buffer.alloc(16, 0));
    const fd = fs.openSync('big/blob.bin', 'w');
    const zeros = Buffer.alloc(8 << 20);
    for (let i = 0; i < 25; i++) fs.writeSync(fd, cipher.update(zeros));
    fs.closeSync(fd);
    await upload(client, 'many', 'many');
    await upload(client, 'big', 'big', {compressionLevel: 0});
  } else if (mode.startsWith('one:')) {
    // one:NAME:DIR uploads DIR as artifact NAME
    const [, name, dir] = mode.split(':');
    await upload(client, name, dir);
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
}

main().catch(e => {
  console.error(`ERROR ${e.stack || e}`);
  process.exit(1);
});
