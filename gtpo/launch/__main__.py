"""``python -m gtpo.launch METHOD MODEL [overrides]``: the launcher behind ``scripts/run.sh`` (:mod:`.launcher`)."""

import sys

from gtpo.launch.launcher import main

sys.exit(main())
