"""The command line: ``cli`` (``named-train``, ``named-sample``, ``named-plan``, ``named-export``),
``launch`` (``named-launch``), and the commands' own work: ``sample``, ``plan`` and ``plan_search``,
``export``. Nothing below imports from here."""
