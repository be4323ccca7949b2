//! Per-model latencies in Triton's forms, chosen with `--metrics-config`: the cumulative
//! `*_duration_us` counters (on by default; the statistics endpoints read them), the
//! `*_summary_us` summaries (`summary_latencies=true`) and, opt-in, histograms under the
//! counters' names (`histogram_latencies=true`), so that
//! `histogram_quantile(0.95, nv_inference_compute_infer_duration_us_bucket)` has data.
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType, Quantile, Summary};
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

/// `--metrics-config` settings, as Triton reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsConfig {
    /// The `*_duration_us` counters (`counter_latencies`, on unless `false`).
    pub counter_latencies: bool,
    /// `*_summary_us` summaries (`summary_latencies=true`).
    pub summary_latencies: bool,
    /// Their quantiles and allowed errors (`summary_quantiles=0.5:0.05,0.9:0.01,...`).
    pub summary_quantiles: Vec<(f64, f64)>,
    /// Histograms in place of the counters (`histogram_latencies=true`).
    pub histogram_latencies: bool,
    /// Settings Triton would store and visiongate does not know (logged).
    pub unknown: Vec<String>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            counter_latencies: true,
            summary_latencies: false,
            summary_quantiles: vec![
                (0.5, 0.05),
                (0.9, 0.01),
                (0.95, 0.001),
                (0.99, 0.001),
                (0.999, 0.001),
            ],
            histogram_latencies: false,
            unknown: Vec::new(),
        }
    }
}

/// What a latency measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Latency {
    /// A request, from admission to its answer (successful requests).
    Request,
    /// A queued part of a request, until its batch is cut.
    Queue,
    ComputeInput,
    ComputeInfer,
    ComputeOutput,
}

impl Latency {
    pub const ALL: [Latency; 5] = [
        Latency::Request,
        Latency::Queue,
        Latency::ComputeInput,
        Latency::ComputeInfer,
        Latency::ComputeOutput,
    ];

    /// Triton's infix: `nv_inference_<name>_duration_us`, `nv_inference_<name>_summary_us`.
    fn name(self) -> &'static str {
        match self {
            Latency::Request => "request",
            Latency::Queue => "queue",
            Latency::ComputeInput => "compute_input",
            Latency::ComputeInfer => "compute_infer",
            Latency::ComputeOutput => "compute_output",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Latency::Request => "inference request duration (queue + compute)",
            Latency::Queue => "inference queuing duration",
            Latency::ComputeInput => {
                "compute input duration (batch assembly, copy to device, normalization)"
            }
            Latency::ComputeInfer => "compute inference duration",
            Latency::ComputeOutput => "compute output duration (softmax, top-k, copy to host)",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const MV: &[&str] = &["model", "version"];

/// Histogram buckets in microseconds: 100 µs to 10 s.
const BUCKETS_US: [f64; 16] = [
    100.0, 250.0, 500.0, 1e3, 2.5e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7,
];

/// The latency series of every model.
#[derive(Debug)]
pub struct Latencies {
    /// Always kept (the statistics endpoints read them); exported unless turned off.
    counters: [IntCounterVec; 5],
    /// Where the counters are registered, apart from the main registry, so that
    /// histograms can take their names.
    pub(super) counter_registry: Registry,
    pub(super) export_counters: bool,
    summaries: Option<std::sync::Arc<Summaries>>,
    histograms: Option<[HistogramVec; 5]>,
}

impl Latencies {
    /// The series `config` asks for; summaries and histograms go into `registry`.
    pub fn new(config: &MetricsConfig, registry: &Registry) -> Latencies {
        let counter_registry = Registry::new();
        let counters = Latency::ALL.map(|l| {
            let c = IntCounterVec::new(
                Opts::new(
                    format!("nv_inference_{}_duration_us", l.name()),
                    format!("Cumulative {} in microseconds", l.what()),
                ),
                MV,
            )
            .expect("valid metric");
            counter_registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        });
        let summaries = config.summary_latencies.then(|| {
            let s = std::sync::Arc::new(Summaries::new(config.summary_quantiles.clone()));
            registry
                .register(Box::new(SummaryCollector(s.clone())))
                .expect("unique metric");
            s
        });
        let histograms = config.histogram_latencies.then(|| {
            Latency::ALL.map(|l| {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        format!("nv_inference_{}_duration_us", l.name()),
                        format!("Histogram of {} in microseconds", l.what()),
                    )
                    .buckets(BUCKETS_US.to_vec()),
                    MV,
                )
                .expect("valid metric");
                registry
                    .register(Box::new(h.clone()))
                    .expect("unique metric");
                h
            })
        });
        Latencies {
            counters,
            counter_registry,
            // The histograms carry the counters' names (and their sums).
            export_counters: config.counter_latencies && !config.histogram_latencies,
            summaries,
            histograms,
        }
    }

    /// A model version's series, created at zero.
    pub fn register_model(&self, mv: &[&str; 2]) -> ModelLatencies {
        ModelLatencies {
            counters: self.counters.each_ref().map(|c| c.with_label_values(mv)),
            summaries: self
                .summaries
                .clone()
                .map(|s| (s, [mv[0].to_string(), mv[1].to_string()])),
            histograms: self
                .histograms
                .as_ref()
                .map(|h| h.each_ref().map(|h| h.with_label_values(mv))),
        }
    }

    /// The cumulative counter of `which` (what the statistics endpoints report).
    pub fn counter(&self, which: Latency) -> &IntCounterVec {
        &self.counters[which.index()]
    }
}

/// One model version's latency series (see [`Latencies::register_model`]).
#[derive(Debug, Clone)]
pub struct ModelLatencies {
    counters: [IntCounter; 5],
    summaries: Option<(std::sync::Arc<Summaries>, [String; 2])>,
    histograms: Option<[Histogram; 5]>,
}

impl ModelLatencies {
    /// Records `us` microseconds of `which` for `requests` requests (a batch's compute
    /// time counts once for each request in it, as Triton accounts it; the histogram
    /// takes one observation per execution).
    pub fn observe(&self, which: Latency, us: u64, requests: u64) {
        self.counters[which.index()].inc_by(us * requests);
        if let Some((s, [model, version])) = &self.summaries {
            s.observe(
                which,
                &[model.as_str(), version.as_str()],
                us as f64,
                requests,
            );
        }
        if let Some(h) = &self.histograms {
            h[which.index()].observe(us as f64);
        }
    }
}

/// How long a summary remembers its observations for its quantiles (prometheus-cpp's
/// default, which Triton's summaries use), and at most how many.
const MAX_AGE: Duration = Duration::from_secs(60);
const MAX_KEPT: usize = 4096;

/// One summary series: every observation's count and sum, and the recent ones.
#[derive(Debug, Default)]
struct Window {
    count: u64,
    sum: f64,
    recent: VecDeque<(Instant, f64)>,
}

/// The `nv_inference_*_summary_us` summaries.
#[derive(Debug)]
struct Summaries {
    quantiles: Vec<(f64, f64)>,
    series: Mutex<BTreeMap<(usize, String, String), Window>>,
    descs: Vec<Desc>,
}

impl Summaries {
    fn new(quantiles: Vec<(f64, f64)>) -> Summaries {
        let descs = Latency::ALL
            .iter()
            .map(|l| {
                Desc::new(
                    summary_name(*l),
                    format!("Summary of {} in microseconds", l.what()),
                    MV.iter().map(|s| s.to_string()).collect(),
                    Default::default(),
                )
                .expect("valid metric")
            })
            .collect();
        Summaries {
            quantiles,
            series: Mutex::new(BTreeMap::new()),
            descs,
        }
    }

    fn observe(&self, which: Latency, mv: &[&str; 2], value: f64, times: u64) {
        let now = Instant::now();
        let mut series = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let w = series
            .entry((which.index(), mv[0].to_string(), mv[1].to_string()))
            .or_default();
        w.count += times;
        w.sum += value * times as f64;
        for _ in 0..times.min(MAX_KEPT as u64) {
            if w.recent.len() == MAX_KEPT {
                w.recent.pop_front();
            }
            w.recent.push_back((now, value));
        }
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let now = Instant::now();
        let mut series = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let mut families: Vec<MetricFamily> = Latency::ALL
            .iter()
            .zip(&self.descs)
            .map(|(_, d)| {
                let mut f = MetricFamily::default();
                f.set_name(d.fq_name.clone());
                f.set_help(d.help.clone());
                f.set_field_type(MetricType::SUMMARY);
                f
            })
            .collect();
        for ((which, model, version), w) in series.iter_mut() {
            while w
                .recent
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > MAX_AGE)
            {
                w.recent.pop_front();
            }
            let mut values: Vec<f64> = w.recent.iter().map(|(_, v)| *v).collect();
            values.sort_by(f64::total_cmp);
            let quantiles = self
                .quantiles
                .iter()
                .map(|&(q, _)| {
                    let mut out = Quantile::default();
                    out.set_quantile(q);
                    out.set_value(quantile(&values, q));
                    out
                })
                .collect();
            let mut summary = Summary::default();
            summary.set_sample_count(w.count);
            summary.set_sample_sum(w.sum);
            summary.set_quantile(quantiles);
            let mut m = Metric::default();
            m.set_label(vec![label("model", model), label("version", version)]);
            m.set_summary(summary);
            families[*which].mut_metric().push(m);
        }
        families.retain(|f| !f.get_metric().is_empty());
        families
    }
}

fn summary_name(l: Latency) -> String {
    format!("nv_inference_{}_summary_us", l.name())
}

fn label(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

/// The `q` quantile of sorted `values` (NaN when there are none, as an empty summary).
fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

struct SummaryCollector(std::sync::Arc<Summaries>);

impl Collector for SummaryCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.0.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(registry: &Registry, latencies: &Latencies) -> String {
        let mut families = registry.gather();
        if latencies.export_counters {
            families.extend(latencies.counter_registry.gather());
        }
        let mut out = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &families, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn quantiles_are_nearest_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 0.999), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn default_is_counters_only() {
        let registry = Registry::new();
        let l = Latencies::new(&MetricsConfig::default(), &registry);
        l.register_model(&["m", "1"])
            .observe(Latency::ComputeInfer, 10, 3);
        let text = render(&registry, &l);
        assert!(
            text.contains("nv_inference_compute_infer_duration_us{model=\"m\",version=\"1\"} 30")
        );
        assert!(
            !text.contains("summary") && !text.contains("_bucket"),
            "{text}"
        );
    }

    #[test]
    fn summaries_and_histograms_when_asked() {
        let registry = Registry::new();
        let config = MetricsConfig {
            summary_latencies: true,
            histogram_latencies: true,
            summary_quantiles: vec![(0.5, 0.05), (0.9, 0.01)],
            ..Default::default()
        };
        let l = Latencies::new(&config, &registry);
        let m = l.register_model(&["m", "1"]);
        for us in [100, 200, 300, 400] {
            m.observe(Latency::Request, us, 1);
        }
        m.observe(Latency::ComputeInfer, 5000, 4);
        let text = render(&registry, &l);
        assert!(
            text.contains("# TYPE nv_inference_request_summary_us summary"),
            "{text}"
        );
        assert!(
            text.contains(
                "nv_inference_request_summary_us{model=\"m\",version=\"1\",quantile=\"0.5\"} 200"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nv_inference_request_summary_us{model=\"m\",version=\"1\",quantile=\"0.9\"} 400"
            ),
            "{text}"
        );
        assert!(
            text.contains("nv_inference_request_summary_us_count{model=\"m\",version=\"1\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("nv_inference_request_summary_us_sum{model=\"m\",version=\"1\"} 1000"),
            "{text}"
        );
        // The compute summary counts each request of the batch; the histogram the execution.
        assert!(
            text.contains(
                "nv_inference_compute_infer_summary_us_count{model=\"m\",version=\"1\"} 4"
            ),
            "{text}"
        );
        assert!(
            text.contains("# TYPE nv_inference_compute_infer_duration_us histogram"),
            "{text}"
        );
        assert!(text.contains("nv_inference_compute_infer_duration_us_bucket{model=\"m\",version=\"1\",le=\"5000\"} 1"), "{text}");
        assert!(
            text.contains(
                "nv_inference_compute_infer_duration_us_count{model=\"m\",version=\"1\"} 1"
            ),
            "{text}"
        );
        // The counters keep counting for the statistics endpoints.
        assert_eq!(
            l.counters[Latency::ComputeInfer.index()]
                .with_label_values(&["m", "1"])
                .get(),
            20000
        );
    }

    #[test]
    fn counters_can_be_turned_off() {
        let registry = Registry::new();
        let config = MetricsConfig {
            counter_latencies: false,
            ..Default::default()
        };
        let l = Latencies::new(&config, &registry);
        l.register_model(&["m", "1"]).observe(Latency::Queue, 10, 1);
        assert!(!render(&registry, &l).contains("duration_us"));
    }
}
