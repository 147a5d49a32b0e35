"""python -m lowband.plan ... (the same as `lowband plan ...`)."""

from lowband.plan.cli import main

raise SystemExit(main())
