"""``python -m pagedkv.cluster`` (see :mod:`pagedkv.cluster.cli`)."""

import sys

from pagedkv.cluster.cli import main

sys.exit(main())
