"""`verst` whose checkpoint commit of step $VERST_TEST_STALL_STEP stops after writing and syncing its
files, before the rename that makes it a checkpoint, and touches $VERST_TEST_STALL_MARKER: a chaos test
kills the driver there, in the middle of a save."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from verst.cli.main import main
from verst.monitor import checkpoint_dirs as layout

_commit = layout.commit


def stalled_commit(tmp: Path, manifest: dict, keep_last: int | None = None) -> Path:
    if manifest["step"] != int(os.environ["VERST_TEST_STALL_STEP"]):
        return _commit(tmp, manifest, keep_last)
    (tmp / layout.MANIFEST_FILE).write_text(json.dumps(manifest))
    layout._fsync_tree(tmp)
    Path(os.environ["VERST_TEST_STALL_MARKER"]).write_text(str(tmp))
    time.sleep(3600)  # until killed
    raise AssertionError("the stalled commit was not killed")


layout.commit = stalled_commit

if __name__ == "__main__":
    sys.exit(main())
