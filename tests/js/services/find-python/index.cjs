// setup-python's first move (useCpythonVersion): tc.find('Python', spec, arch)
// in RUNNER_TOOL_CACHE; a miss there is where setup-python would download, so
// offline it fails with setup-python's message; a hit goes on PATH with
// pythonLocation and the python-version / python-path outputs.
const path = require('path');
const os = require('os');
const core = require('@actions/core');
const tc = require('@actions/tool-cache');

try {
  const version = core.getInput('python-version', {required: true});
  const arch = core.getInput('architecture') || os.arch();
  const installDir = tc.find('Python', version, arch);
  if (!installDir) {
    core.info(`Version ${version} was not found in the local cache`);
    throw new Error(`The version '${version}' with architecture '${arch}' was not found for this operating system.`);
  }
  const binDir = path.join(installDir, 'bin');
  core.exportVariable('pythonLocation', installDir);
  core.exportVariable('Python_ROOT_DIR', installDir);
  core.exportVariable('Python3_ROOT_DIR', installDir);
  core.addPath(installDir);
  core.addPath(binDir);
  // the tool cache's layout: <root>/Python/<version>/<arch>
  core.setOutput('python-version', path.basename(path.dirname(installDir)));
  core.setOutput('python-path', path.join(binDir, 'python'));
  core.info(`Successfully set up CPython (${path.basename(path.dirname(installDir))})`);
} catch (e) {
  core.setFailed(e.message);
}
