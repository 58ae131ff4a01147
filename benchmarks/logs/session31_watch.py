"""Runs a script (argv[1:]) with every thread's stack dumped to stderr after WATCH_S seconds, then exit."""
import faulthandler, os, runpy, sys
faulthandler.dump_traceback_later(float(os.environ.get("WATCH_S", "60")), exit=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
