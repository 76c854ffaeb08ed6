"""The run's weights as the controller sees them: it moves no bytes and keeps
no copy of who serves what. The synchronizer owns versions, the trainer
publishes them, every replica follows; the controller hands over the run's
policy, asks for the versions the run needs outside the schedule, and judges
each fleet update from the results the replicas report (`fleet.py`, the
verdict itself in `verdict.py`); it holds the newest committed version in one
place (`newest.py`), records the synchronizer's events and hears of every
component that joins or leaves (`observer.py`)."""
