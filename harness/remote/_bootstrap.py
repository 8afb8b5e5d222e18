"""The zipapp's `__main__.py` (harness/remote/__init__.py puts it there): runs the tools from a copy of
the zipapp unpacked beside it, where the host's Python keeps their bytecode. Python caches no bytecode
for modules it imports from a zip, so every start compiled the agent again (20 ms of CPU) and the
benchmark client (40 ms), several times a run on every host. The copy is named by the zipapp's CRC-32
and size, made whole under a name of its own and then renamed into place (two tools starting at once
both end up using one whole copy); where it cannot be made (a read-only folder, a full disk), the
tools run from the zip itself, as they always could. Standard library only, Python >= 3.9, like the
tools.
"""

import os
import sys
import zlib


def unpacked(pyz):
    """The folder to import the tools from: the unpacked copy of `pyz`, made if need be, else `pyz`."""
    try:
        with open(pyz, "rb") as f:
            data = f.read()
    except OSError:
        return pyz
    here = os.path.join(os.path.dirname(os.path.abspath(pyz)),
                        ".harness_host-%08x-%d" % (zlib.crc32(data), len(data)))
    if os.path.isdir(here):
        return here
    import shutil
    import tempfile
    import zipfile
    part = ""
    try:
        # a name no other start takes, on this host or on another sharing the folder (a home on NFS)
        part = tempfile.mkdtemp(prefix=os.path.basename(here) + ".part-", dir=os.path.dirname(here))
        with zipfile.ZipFile(pyz) as z:
            z.extractall(part, [name for name in z.namelist() if name.startswith("harness_host/")])
        os.rename(part, here)
    except (OSError, zipfile.BadZipFile):
        if part:   # another start's copy won the rename, or none could be made
            shutil.rmtree(part, ignore_errors=True)
    return here if os.path.isdir(here) else pyz


if __name__ == "__main__":
    sys.path[0] = unpacked(sys.path[0])
    # PYTHONDONTWRITEBYTECODE (container images often set it) would keep the copy without bytecode; the
    # copy is the harness's own, in its own workdir, so the tool's bytecode is written there regardless.
    # What the tool imports after (torchprof runs the engine's server in this process) keeps the host's
    # setting.
    host_setting, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    from harness_host.__main__ import TOOLS, main  # type: ignore[import-not-found]  # the zipapp's own package
    if sys.argv[1:2] and sys.argv[1] in TOOLS:
        __import__("harness_host." + sys.argv[1])
    sys.dont_write_bytecode = host_setting
    sys.exit(main())
