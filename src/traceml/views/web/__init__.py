"""The web dashboard: app.py serves a run (live or finished), queries.py reads its store, static/ is the page."""
