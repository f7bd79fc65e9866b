from crossfed.cli import main

raise SystemExit(main())
