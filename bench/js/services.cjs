// bench/test_services.py: one round trip through preloop's services with GitHub's clients.
// artifact SRC DEST LEVEL: upload SRC as an artifact, download it into DEST.
// cache SRC KEY: save SRC under KEY, remove SRC, restore it.
// client SRC DEST LEVEL: what the artifact client does on its own, with no
//   service: its zip of SRC (createZipUploadStream, sha256 alongside) into a
//   file, then the unzip download does (unzip-stream, sha256 alongside) into DEST.
const fs = require('fs');
const path = require('path');
const stream = require('stream');
const crypto = require('crypto');

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
  } else if (mode === 'client') {
    require('@actions/artifact'); // its load is part of every step using it
    const {createZipUploadStream} = require('@actions/artifact/lib/internal/upload/zip');
    const spec = require('@actions/artifact/lib/internal/upload/upload-zip-specification');
    const unzip = require('unzip-stream');
    const [src, dest, level] = args;
    const zipped = path.join(process.env.RUNNER_TEMP, 'client.zip');
    const files = spec.getUploadZipSpecification(walk(src), src);
    const zip = await createZipUploadStream(files, +level);
    zip.pipe(crypto.createHash('sha256'));
    await stream.promises.pipeline(zip, fs.createWriteStream(zipped));
    // as download does: a PassThrough into a sha256 and unzip-stream, done at 'close'
    const through = new stream.PassThrough();
    fs.createReadStream(zipped).pipe(through);
    through.pipe(crypto.createHash('sha256'));
    await new Promise((resolve, reject) => {
      through.pipe(unzip.Extract({path: dest})).on('close', resolve).on('error', reject);
    });
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
