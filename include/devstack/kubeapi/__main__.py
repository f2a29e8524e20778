from include.devstack.kubeapi.server import main

raise SystemExit(main())
