"""What a run trains on: the tasks and how an answer to one is scored. The
data loader hands out tasks (`loader`: files or in-memory rows, shuffled per
epoch, its cursor checkpointed with the tasks in flight), rewards score a
completion (`rewards`: functions registered by name or named as
'module:function'), and math answers are extracted and compared (`answers`)."""
