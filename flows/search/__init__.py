"""The search loop every search runs: the op search, the engine search, the sweep's children, and
any new one. A search is set up, handed to `run_search`, then published; the loop owns the
order of things and every stop rule, the search owns where candidates come from and go.

A search plugs in as a `Search` (loop.py), a dataclass of plain callables:

    Search(stops=Progress(target),          # the budget's rules and running totals (stops.py)
           run=lambda item: task.submit(item),   # start a candidate on a slot: a future of its outcome
           room=lambda busy: free_places,   # how many more may start now
           report=print_and_log,            # an outcome, after the stops counted it
           sources=[orphans, proposer],     # Batch: `take(n)` gives up to n ready candidates now,
                                            #   `exhausted` says why one gave none
           replies=llm,                     # Replies: `ask()` a future, `take(reply)` -> a candidate,
                                            #   Done(outcome) judged without the pool, or Down(reason)
           held=needs_a_person, decide=ask_the_person,
           requeue=fresh_run_of)            # a candidate whose slot died mid-run, run once more

A candidate ("item") is whatever `run` takes, with its pending run already open; an outcome has
`charge` (a tracking.ledger.Charge) and `score` (None unless it passed). Each round the loop:

1. decides the held candidates, once nothing is in flight, and reports them;
2. fills min(room, candidates left) places — re-queued candidates first, then each source in
   order, then replies asked for — unless a stop rule holds (stops.Progress.may_launch), the
   endpoint is down or a candidate waits for a person;
3. waits for the first candidate or reply to finish (or a reply's deadline, `Replies.timeout_s`)
   and takes it: an outcome is held or reported; a reply is run, reported or stops proposing;
   a candidate that raised is re-queued once (`requeue`), a second time it fails the search.

It ends when nothing is in flight or held and nothing more may start, prints and returns the
stop reason (`Stopped`): the endpoint down, a budget rule — tokens, dollars, GPU-hours, the
count, the wall clock, a plateau — an exhausted space, or no candidate left. A source that raises
stops anything new from starting; what is in flight finishes and is reported, then it is raised.
"""
from flows.search.loop import Batch, Done, Down, Replies, Search, Stopped, run_search
from flows.search.stops import Progress

__all__ = ["Batch", "Done", "Down", "Progress", "Replies", "Search", "Stopped", "run_search"]
