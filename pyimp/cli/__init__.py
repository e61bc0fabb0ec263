"""The console scripts: ``pyimp-run`` (``run``), ``pyimp-tokenize`` (``tokenize``),
``pyimp-fetch-model`` (``fetch_model``), the helpers they share (``common``) and pyimp-run's
pictures (``plotting``). ``pyimp-dump`` and ``pyimp-compare`` live in :mod:`pyimp.trace`."""
