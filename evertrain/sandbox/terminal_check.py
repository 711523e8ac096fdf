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

The check helpers verify what a task asks for, never less (the checks of every task use them):

- ``read(path)`` reads a REGULAR file reached without a symbolic link: a folder, a link, a fifo where a
  file was asked is a failed check, not its target's content;
- ``is_file``, ``is_dir`` say the type of a path without following a link; ``gone(path)``: nothing at all
  is there (a dangling link or a renamed copy is not a delete: see ``tree``);
- ``lines(path)``: the file's lines, for answers asked one item per line (``.split()`` would take one line
  of words for them);
- ``tree(folder)``: every path under a folder with its type (``file``, ``dir``, ``link``, ``other``), for
  checks of the whole layout (a rename left behind where a delete was asked, an extra file);
- a workspace holding a symbolic link, or a file with more than one hard link, fails every task that does
  not declare ``links`` (its header line below): a link where a copy, a file or a folder was asked.

Standard library only: it runs in the sandbox's bare interpreter, never imported by evertrain.
"""

import contextlib
import ctypes
import os
import stat
import subprocess
import sys
import tarfile

# the first line: the nonce, then the task's options (``links``: the task is about links)
header, _, source = sys.stdin.read().partition('\n')
nonce, *options = header.split()
sys.stdin.close()
with contextlib.suppress(OSError):
    os.close(0)
with contextlib.suppress(Exception):
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
try:
    with tarfile.open('/sandbox/workspace.tar') as archive:
        archive.extractall('/tmp', filter='data')
except tarfile.FilterError as error:  # a link out of the workspace: no task asks for one
    print('FAIL the workspace holds a link out of it: ' + ' '.join(str(error).split())[:150])
    sys.exit(0)
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

class CheckFailed(AssertionError):
    pass


def _path(path):
    """The workspace path of ``path``, refused when it leaves the workspace."""
    full = os.path.normpath(os.path.join('/tmp', path))
    if full != '/tmp' and not full.startswith('/tmp/'):
        raise CheckFailed(f'{path} is outside the workspace')
    return full


def _through_link(full):
    """Whether a folder on the way to ``full`` (not ``full`` itself) is a symbolic link."""
    parts = os.path.relpath(full, '/tmp').split(os.sep)
    here = '/tmp'
    for part in parts[:-1]:
        here = os.path.join(here, part)
        if os.path.islink(here):
            return True
    return False


def kind(path):
    """What is at ``path``, never following a link: 'file', 'dir', 'link', 'other' or None (nothing)."""
    full = _path(path)
    if _through_link(full):
        return 'link'
    try:
        mode = os.lstat(full).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return 'link'
    if stat.S_ISREG(mode):
        return 'file'
    return 'dir' if stat.S_ISDIR(mode) else 'other'


def is_file(path):
    return kind(path) == 'file'


def is_dir(path):
    return kind(path) == 'dir'


def gone(path):
    """Nothing at all is at ``path``: not a file, not a folder, not even a dangling link."""
    return kind(path) is None


def exists(path):
    """Something is at ``path`` (a link counts, followed or not: use is_file, is_dir or read to check what)."""
    return kind(path) is not None


def read(path):
    """The text of the regular file ``path``; a failed check when it is anything else."""
    found = kind(path)
    if found != 'file' and not (allow_links and found == 'link' and os.path.isfile(_path(path))):
        raise CheckFailed(f'{path} is not a file' if found else f'{path} is missing')
    with open(_path(path), encoding='utf-8', errors='replace') as f:
        return f.read()


def lines(path):
    """The lines of the regular file ``path`` (without their line breaks)."""
    return read(path).splitlines()


def tree(folder='.'):
    """Every path under ``folder`` (relative to it, '/'-separated) with its kind, links not followed."""
    top = _path(folder)
    if kind(folder) != 'dir':
        raise CheckFailed(f'{folder} is not a folder')
    found = {}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            full = os.path.join(root, name)
            found[os.path.relpath(full, top).replace(os.sep, '/')] = kind(os.path.relpath(full, '/tmp'))
    return found


def _links():
    """The workspace's symbolic links and multiply-linked files (a hard link is a link too)."""
    found = []
    for root, dirs, files in os.walk('/tmp'):
        for name in dirs + files:
            full = os.path.join(root, name)
            info = os.lstat(full)
            if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
                found.append(os.path.relpath(full, '/tmp'))
    return sorted(found)


allow_links = 'links' in options
scope = {'sh': sh, 'read': read, 'lines': lines, 'exists': exists, 'is_file': is_file, 'is_dir': is_dir,
         'gone': gone, 'kind': kind, 'tree': tree, '__name__': 'check'}
try:
    links = [] if allow_links else _links()
    if links:
        raise CheckFailed(f'the workspace holds links ({", ".join(links[:3])}); the task asks for none')
    exec(compile(source, 'check.py', 'exec'), scope)
except AssertionError as error:
    print('FAIL ' + ' '.join(str(error).split())[:200])
    sys.exit(0)
except Exception as error:
    print('FAIL ' + type(error).__name__ + ': ' + ' '.join(str(error).split())[:200])
    sys.exit(0)
print('PASS ' + nonce)
