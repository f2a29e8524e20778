from include.devstack.stack import main

raise SystemExit(main())
