"""The control plane: the Scheduler's event loops, ScheduleBatch and Req, SchedulePolicy and PrefillAdder,
the encoding stage, the RadixCache and the PD prefill and decode queues."""
