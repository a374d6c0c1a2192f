"""KITE arbitrator: turns telemetry into decisions that steer Upcycle and YOCO (decisions: issue 5)."""
