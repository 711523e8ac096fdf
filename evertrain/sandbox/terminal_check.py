"""Runs inside a fresh sandbox as /sandbox/main.py: the nonce comes on stdin, then stdin is closed and the
process made non-dumpable BEFORE anything of the workspace runs; the workspace is unpacked into /tmp; the
task's checker (/sandbox/check.py) runs in this process with helpers that run workspace programs only as
subprocesses. PASS <nonce> only after the checker returned.

Standard library only: it runs in the sandbox's bare interpreter, never imported by evertrain.
"""

import contextlib
import ctypes
import os
import subprocess
import sys
import tarfile

nonce = sys.stdin.readline().strip()
os.close(0)
with contextlib.suppress(Exception):
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
with tarfile.open('/sandbox/workspace.tar') as archive:
    archive.extractall('/tmp', filter='data')
os.chdir('/tmp')

def sh(command, timeout=5.0, stdin=''):
    '''Run a shell command in the workspace; (exit status, stdout, stderr) as plain strings.'''
    try:
        done = subprocess.run(['/bin/bash', '-c', command], cwd='/tmp', input=stdin.encode(),
                              capture_output=True, timeout=timeout, env=dict(os.environ, BASH_ENV='/sandbox/bashrc'))
    except subprocess.TimeoutExpired:
        return None, '', 'timeout'
    return done.returncode, done.stdout.decode('utf-8', 'replace'), done.stderr.decode('utf-8', 'replace')

def read(path):
    with open(os.path.join('/tmp', path), encoding='utf-8', errors='replace') as f:
        return f.read()

def exists(path):
    return os.path.exists(os.path.join('/tmp', path))

with open('/sandbox/check.py', encoding='utf-8') as f:
    source = f.read()
scope = {'sh': sh, 'read': read, 'exists': exists, '__name__': 'check'}
try:
    exec(compile(source, 'check.py', 'exec'), scope)
except AssertionError as error:
    print('FAIL ' + ' '.join(str(error).split())[:200])
    sys.exit(0)
except Exception as error:
    print('FAIL ' + type(error).__name__ + ': ' + ' '.join(str(error).split())[:200])
    sys.exit(0)
print('PASS ' + nonce)
