from perfrun.cli import main

raise SystemExit(main())
