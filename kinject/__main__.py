"""``python -m kinject ...`` is the ``kinject`` command."""

from kinject.app.cli import main

raise SystemExit(main())
