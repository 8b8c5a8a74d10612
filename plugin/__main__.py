from moeplug.commands.main import main

raise SystemExit(main())
