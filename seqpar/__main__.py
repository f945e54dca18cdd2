from seqpar.cli import main

raise SystemExit(main())
