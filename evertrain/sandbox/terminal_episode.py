"""Runs inside the sandbox as /sandbox/main.py: unpack the workspace into /tmp, run each command of
/sandbox/commands.json with bash in it, and print one JSON line: each command's exit status, seconds, output
size and (cut) output, and with "--tar" the workspace afterwards as a base64 tar archive.

Standard library only: it runs in the sandbox's bare interpreter, never imported by evertrain.
"""

import base64
import contextlib
import ctypes
import io
import json
import os
import subprocess
import sys
import tarfile
import time

with contextlib.suppress(Exception):
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: commands cannot reach this process
limit, timeout = int(sys.argv[1]), float(sys.argv[2])
want_tar = '--tar' in sys.argv
with tarfile.open('/sandbox/workspace.tar') as archive:
    archive.extractall('/tmp', filter='data')
env = dict(os.environ, BASH_ENV='/sandbox/bashrc')
with open('/sandbox/commands.json', encoding='utf-8') as f:
    commands = json.load(f)
results = []
for command in commands:
    began = time.monotonic()
    # output goes to a memfd: bounded by RLIMIT_FSIZE, never a file in the workspace, never a pipe to drain
    sink = os.memfd_create('output')
    proc = subprocess.Popen(['/bin/bash', '-c', command], cwd='/tmp', stdin=subprocess.DEVNULL, stdout=sink,
                            stderr=sink, start_new_session=True, env=env)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, 9)  # whatever the command left running in its group goes too
    if code is None:
        proc.wait()
    size = os.fstat(sink).st_size
    data = os.pread(sink, limit, 0)
    os.close(sink)
    results.append({'exit': code, 'seconds': round(time.monotonic() - began, 3), 'bytes': size,
                    'output': data.decode('utf-8', 'replace')})
out = {'results': results}
if want_tar:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w') as archive:
        for name in sorted(os.listdir('/tmp')):
            archive.add(os.path.join('/tmp', name), arcname=name)
    out['workspace'] = base64.b64encode(buffer.getvalue()).decode()
sys.stdout.write('\n' + json.dumps(out) + '\n')
