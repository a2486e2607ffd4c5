from kvdepot.cli import main; import sys; sys.exit(main())
