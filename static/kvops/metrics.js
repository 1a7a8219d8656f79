// An engine's metrics over time: one point a second, from the Redis history on load and
// from the live messages after; counters become per-second rates.

export class MetricsHistory {
  constructor(limit = 600) {
    this.limit = limit;
    this.points = [];
  }

  load(points) {
    this.points = points.slice(-this.limit);
  }

  add(point) {
    const last = this.points[this.points.length - 1];
    if (last && point.ts - last.ts < 0.95) return false;
    this.points.push(point);
    if (this.points.length > this.limit) this.points.shift();
    return true;
  }

  field(name) { return this.points.map((p) => p[name] ?? null); }

  // Per interval: how much a counter grew (0 across a restart, when counters reset).
  rate(name) {
    return this.points.map((p, i) => (i === 0 ? null : Math.max(0, (p[name] ?? 0) - (this.points[i - 1][name] ?? 0))));
  }

  // How much each counter of a map (e.g. missed_tokens_by_reason: {reason: total}) grew
  // from the last point at or before `since` (Unix seconds; the oldest point when none
  // is that old) to the newest. Points without the map are passed over. A counter that
  // went down started again from zero (the engine restarted): what it counts since then
  // is its new value. Returns {totals: {key: growth}, from: the time of the point counted
  // from}, or null with fewer than two points that have the map.
  increases(name, since) {
    const points = this.points.filter((p) => p[name]);
    if (points.length < 2) return null;
    let start = 0;
    while (start + 1 < points.length && points[start + 1].ts <= since) start++;
    const totals = {};
    for (let i = start + 1; i < points.length; i++) {
      const before = points[i - 1][name];
      for (const [key, value] of Object.entries(points[i][name])) {
        const was = before[key] ?? 0;
        totals[key] = (totals[key] ?? 0) + (value >= was ? value - was : value);
      }
    }
    return { totals, from: points[start].ts };
  }

  // Prefix-cache hit rate of each interval (hits / queried prompt tokens), null if none.
  hitRate() {
    const hits = this.rate("prefix_cache_hits"), queries = this.rate("prefix_cache_queries");
    return hits.map((h, i) => (queries[i] ? h / queries[i] : null));
  }
}

export function cumulativeHitRate(metrics) {
  return metrics && metrics.prefix_cache_queries
    ? metrics.prefix_cache_hits / metrics.prefix_cache_queries : null;
}
