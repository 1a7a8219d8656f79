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
