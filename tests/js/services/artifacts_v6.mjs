// @actions/artifact 6.x, the client of upload-artifact v6+ and download-artifact
// v7+: a directory uploaded as a zip, and one file uploaded as it is
// (upload-artifact's `archive: false`, named after the file), then each
// downloaded into a directory of its own. The client unzips a download only
// when it is served with a zip type, and names a file served as it is after
// its Content-Disposition.
import fs from 'fs';
import {DefaultArtifactClient} from '@actions/artifact-v6';

const client = new DefaultArtifactClient();
const mode = process.argv[2];
if (mode === 'up') {
  fs.mkdirSync('zipme/sub', {recursive: true});
  fs.writeFileSync('zipme/sub/a.txt', 'zipped\n');
  fs.writeFileSync('report.html', '<p>as it is</p>\n');
  let r = await client.uploadArtifact('zipped', ['zipme/sub/a.txt'], 'zipme');
  console.log(`uploaded zipped id=${r.id}`);
  r = await client.uploadArtifact('ignored', ['report.html'], '.', {skipArchive: true});
  console.log(`uploaded report.html id=${r.id}`);
} else {
  for (const name of ['zipped', 'report.html']) {
    const {artifact} = await client.getArtifact(name);
    const r = await client.downloadArtifact(artifact.id, {path: `got/${name}`});
    console.log(`downloaded ${name} digestMismatch=${r.digestMismatch}`);
  }
}
