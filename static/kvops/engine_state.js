// The engine's state as the engine page's header shows it: ready, paused, draining,
// drained, dead... It comes from two places: the engine's deltas (in order, each with the
// state at its step) and the answer to this page's own pause, resume, drain or undrain.
// The answer usually arrives first: deltas the engine sent before it applied the command
// may still be on their way, with the old state. So after an answer, deltas with another
// state do not change the header until one says the answered state (or its successor:
// draining ends drained), or until `holdMs` have passed (another operator's change may
// have followed at once, and its deltas never say ours).
export class HeaderState {
  constructor({ holdMs = 5000, now = () => performance.now() } = {}) {
    this.holdMs = holdMs;
    this.now = now;
    this.shown = null;  // what the header says
    this.answered = null;  // { state, until } after an answer, until the engine agrees
  }

  // A state the engine reported (a delta, or the hello of a new connection). Returns
  // whether the header should now show it.
  fromEngine(state) {
    if (this.answered !== null) {
      const { state: want, until } = this.answered;
      const reached = state === want || (want === "draining" && state === "drained");
      if (!reached && this.now() < until) return false;
      this.answered = null;
    }
    this.shown = state;
    return true;
  }

  // The state in the answer to this page's command: shown at once.
  fromAnswer(state) {
    this.answered = { state, until: this.now() + this.holdMs };
    this.shown = state;
  }
}
