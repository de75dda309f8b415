"""`gym-client webui`: a contributor's web console on 127.0.0.1 (app.py), over the CLI itself.

The Join form is generated from `gym-client join`'s own click options (fields.py), so a setting declared in
TrainConfig or added to join appears here; a start runs the real `gym-client join --json` as a child process
(jobs.py): the contributor's key stays in its file, and closing the page stops nothing.
"""
