// What setup-python does first: look in the runner's tool cache.
const tc = require('@actions/tool-cache');
const spec = process.argv[2];
console.log(`versions ${tc.findAllVersions('Python').sort().join(',')}`);
console.log(`found ${tc.find('Python', spec) || '-'}`);
