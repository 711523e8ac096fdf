"""Runs inside a fresh sandbox as /sandbox/main.py: the nonce and the task's checker come on stdin, then
stdin is closed and the process made non-dumpable BEFORE anything of the workspace runs; the workspace is
unpacked into /tmp; the checker runs in this process with helpers that run workspace programs only as
subprocesses. PASS <nonce> only after the checker returned.

The checker never touches the sandbox's filesystem: it is read from stdin into this process's memory
(which workspace programs cannot read: non-dumpable), so no file of the workspace, and no program the
checker runs, can read the hidden check. This process runs with ``-S -s -B -P`` (see bwrap.py) and a
cleared environment, and imports nothing from /tmp. The workspace is data: the programs the checker runs
get a clean environment of their own (no HOME holding the workspace's dotfiles, no user site, bytecode
read only from a cache folder that does not exist), so a ``usercustomize``, ``.pth`` file, ``.bashrc`` or
stale ``__pycache__`` the agent planted configures nothing.

Standard library only: it runs in the sandbox's bare interpreter, never imported by evertrain.
"""

import contextlib
import ctypes
import os
import subprocess
import sys
import tarfile

nonce, _, source = sys.stdin.read().partition('\n')
nonce = nonce.strip()
sys.stdin.close()
with contextlib.suppress(OSError):
    os.close(0)
with contextlib.suppress(Exception):
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
with tarfile.open('/sandbox/workspace.tar') as archive:
    archive.extractall('/tmp', filter='data')
os.chdir('/tmp')

# The environment of every program the checker runs: fixed here, never read from the workspace.
# HOME does not exist (no ~/.local user site, no dotfiles); PYTHONPYCACHEPREFIX points bytecode lookups
# at a folder that does not exist, so a planted __pycache__ is never loaded.
CLEAN_ENV = {'PATH': '/usr/bin:/bin', 'HOME': '/nonexistent', 'LANG': 'C.UTF-8', 'BASH_ENV': '/sandbox/bashrc',
             'PYTHONNOUSERSITE': '1', 'PYTHONDONTWRITEBYTECODE': '1', 'PYTHONHASHSEED': '0',
             'PYTHONPYCACHEPREFIX': '/nonexistent/pycache'}

def sh(command, timeout=5.0, stdin=''):
    '''Run a shell command in the workspace; (exit status, stdout, stderr) as plain strings.'''
    try:
        done = subprocess.run(['/bin/bash', '-c', command], cwd='/tmp', input=stdin.encode(),
                              capture_output=True, timeout=timeout, env=dict(CLEAN_ENV))
    except subprocess.TimeoutExpired:
        return None, '', 'timeout'
    return done.returncode, done.stdout.decode('utf-8', 'replace'), done.stderr.decode('utf-8', 'replace')

def read(path):
    with open(os.path.join('/tmp', path), encoding='utf-8', errors='replace') as f:
        return f.read()

def exists(path):
    return os.path.exists(os.path.join('/tmp', path))

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
