from moeplug.cli import main

raise SystemExit(main())
