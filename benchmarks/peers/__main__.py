from benchmarks.peers.bench import main

raise SystemExit(main())
