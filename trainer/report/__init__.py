"""What a step reports and where it goes: the typed ``StepReport`` (``step_report``) and the
outputs after each step (``outputs``: console, JSON, TensorBoard, metrics, records file,
export and push, checkpoint, feed acknowledgement)."""
