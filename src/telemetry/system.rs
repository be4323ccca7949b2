//! The host series Triton refreshes every metrics interval: CPU utilisation and memory
//! (from `/proc`), and per GPU (`gpu_uuid` label) utilisation, memory, power and energy,
//! read through a [`GpuProbe`]: NVIDIA's management library loaded at run time
//! (`nvidia::nvml`), or a fake in tests. No library or no GPU: no GPU series, no error.
use std::collections::HashMap;
use std::time::Duration;

use prometheus::{CounterVec, GaugeVec, Opts, Registry};
use tokio_util::sync::CancellationToken;

/// One GPU's reading.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub uuid: String,
    /// Busy share of the last sample period, 0 to 1.
    pub utilization: f64,
    pub memory_total_bytes: f64,
    pub memory_used_bytes: f64,
    pub power_watts: f64,
    pub power_limit_watts: f64,
    /// Energy used since the driver loaded, when the GPU reports it.
    pub energy_joules: Option<f64>,
}

/// Reads every GPU (blocking calls; run off the async threads).
pub trait GpuProbe: Send {
    fn sample(&mut self) -> Vec<GpuSample>;
}

/// The host gauges, registered at start; a series appears once it has a value.
#[derive(Debug)]
pub struct HostMetrics {
    cpu_utilization: GaugeVec,
    cpu_memory_total: GaugeVec,
    cpu_memory_used: GaugeVec,
    gpu_utilization: GaugeVec,
    gpu_memory_total: GaugeVec,
    gpu_memory_used: GaugeVec,
    gpu_power_usage: GaugeVec,
    gpu_power_limit: GaugeVec,
    energy: CounterVec,
}

impl HostMetrics {
    pub fn new(registry: &Registry) -> HostMetrics {
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let gpu = &["gpu_uuid"];
        let energy = CounterVec::new(
            Opts::new(
                "nv_energy_consumption",
                "GPU energy consumption in joules since the server started",
            ),
            gpu,
        )
        .expect("valid metric");
        registry
            .register(Box::new(energy.clone()))
            .expect("unique metric");
        HostMetrics {
            cpu_utilization: gauge(
                "nv_cpu_utilization",
                "CPU utilization rate [0.0 - 1.0]",
                &[],
            ),
            cpu_memory_total: gauge(
                "nv_cpu_memory_total_bytes",
                "CPU total memory (RAM), in bytes",
                &[],
            ),
            cpu_memory_used: gauge(
                "nv_cpu_memory_used_bytes",
                "CPU used memory (RAM), in bytes",
                &[],
            ),
            gpu_utilization: gauge(
                "nv_gpu_utilization",
                "GPU utilization rate [0.0 - 1.0)",
                gpu,
            ),
            gpu_memory_total: gauge(
                "nv_gpu_memory_total_bytes",
                "GPU total memory, in bytes",
                gpu,
            ),
            gpu_memory_used: gauge("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", gpu),
            gpu_power_usage: gauge("nv_gpu_power_usage", "GPU power usage in watts", gpu),
            gpu_power_limit: gauge(
                "nv_gpu_power_limit",
                "GPU power management limit in watts",
                gpu,
            ),
            energy,
        }
    }

    fn set_cpu(&self, cpu: &CpuReading) {
        if let Some(u) = cpu.utilization {
            self.cpu_utilization.with_label_values::<&str>(&[]).set(u);
        }
        if let Some((total, used)) = cpu.memory {
            self.cpu_memory_total
                .with_label_values::<&str>(&[])
                .set(total);
            self.cpu_memory_used
                .with_label_values::<&str>(&[])
                .set(used);
        }
    }

    /// `first_energy`: each GPU's energy reading when the server started.
    fn set_gpus(&self, samples: &[GpuSample], first_energy: &mut HashMap<String, f64>) {
        for s in samples {
            let l = [s.uuid.as_str()];
            self.gpu_utilization
                .with_label_values(&l)
                .set(s.utilization);
            self.gpu_memory_total
                .with_label_values(&l)
                .set(s.memory_total_bytes);
            self.gpu_memory_used
                .with_label_values(&l)
                .set(s.memory_used_bytes);
            self.gpu_power_usage
                .with_label_values(&l)
                .set(s.power_watts);
            self.gpu_power_limit
                .with_label_values(&l)
                .set(s.power_limit_watts);
            if let Some(e) = s.energy_joules {
                let first = *first_energy.entry(s.uuid.clone()).or_insert(e);
                let counter = self.energy.with_label_values(&l);
                let more = (e - first) - counter.get();
                if more > 0.0 {
                    counter.inc_by(more);
                }
            }
        }
    }
}

/// `/proc/stat`'s first line: (busy, total) jiffies of all CPUs together.
fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// `/proc/meminfo`: (MemTotal, MemTotal - MemAvailable) in bytes.
fn memory(meminfo: &str) -> Option<(f64, f64)> {
    let kib = |key: &str| -> Option<f64> {
        let rest = meminfo.lines().find_map(|l| l.strip_prefix(key))?;
        rest.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<f64>()
            .ok()
    };
    let (total, available) = (kib("MemTotal:")?, kib("MemAvailable:")?);
    Some((total * 1024.0, (total - available) * 1024.0))
}

struct CpuReading {
    utilization: Option<f64>,
    memory: Option<(f64, f64)>,
}

/// CPU utilisation since the previous reading.
#[derive(Default)]
struct CpuMeter {
    last: Option<(u64, u64)>,
}

impl CpuMeter {
    fn read(&mut self, stat: &str, meminfo: &str) -> CpuReading {
        let now = cpu_times(stat);
        let utilization = match (self.last, now) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
                Some((b1.saturating_sub(b0)) as f64 / (t1 - t0) as f64)
            }
            _ => None,
        };
        if now.is_some() {
            self.last = now;
        }
        CpuReading {
            utilization: utilization.map(|u| u.clamp(0.0, 1.0)),
            memory: memory(meminfo),
        }
    }
}

/// Refreshes the host series every `interval` until `stop`: the CPU's when `cpu`, the
/// GPUs' when `gpu` has a probe.
pub fn spawn_poller(
    metrics: std::sync::Arc<super::Metrics>,
    cpu: bool,
    mut gpu: Option<Box<dyn GpuProbe>>,
    interval: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut meter = CpuMeter::default();
        let mut first_energy = HashMap::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            if cpu {
                let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
                let reading = meter.read(&read("/proc/stat"), &read("/proc/meminfo"));
                metrics.host.set_cpu(&reading);
            }
            if let Some(mut probe) = gpu.take() {
                let Ok((back, samples)) = tokio::task::spawn_blocking(move || {
                    let samples = probe.sample();
                    (probe, samples)
                })
                .await
                else {
                    continue; // the probe panicked: no more GPU readings
                };
                metrics.host.set_gpus(&samples, &mut first_energy);
                gpu = Some(back);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT_1: &str = "cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n";
    const STAT_2: &str = "cpu  250 0 150 800 100 0 0 0 0 0\ncpu0 1 2 3\n";
    const MEMINFO: &str =
        "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    4000000 kB\n";

    #[test]
    fn cpu_utilisation_is_busy_time_over_the_interval() {
        let mut m = CpuMeter::default();
        let first = m.read(STAT_1, MEMINFO);
        assert_eq!(first.utilization, None);
        let second = m.read(STAT_2, MEMINFO);
        // 200 busy jiffies of 300.
        assert!((second.utilization.unwrap() - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!(
            second.memory,
            Some((16_000_000.0 * 1024.0, 12_000_000.0 * 1024.0))
        );
        assert_eq!(m.read("garbage", "").memory, None);
    }

    struct FakeGpus {
        energy: f64,
    }

    impl GpuProbe for FakeGpus {
        fn sample(&mut self) -> Vec<GpuSample> {
            self.energy += 50.0;
            vec![GpuSample {
                uuid: "GPU-0fake".into(),
                utilization: 0.75,
                memory_total_bytes: 80e9,
                memory_used_bytes: 2e9,
                power_watts: 300.0,
                power_limit_watts: 700.0,
                energy_joules: Some(self.energy),
            }]
        }
    }

    #[tokio::test]
    async fn gpu_series_come_from_the_probe_with_energy_since_start() {
        let metrics = std::sync::Arc::new(super::super::Metrics::new());
        assert!(
            !metrics.render().contains("nv_gpu_"),
            "no GPU series before a probe"
        );
        let stop = CancellationToken::new();
        let task = spawn_poller(
            metrics.clone(),
            true,
            Some(Box::new(FakeGpus { energy: 1000.0 })),
            Duration::from_millis(20),
            stop.clone(),
        );
        let text = loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let text = metrics.render();
            if text.contains("nv_cpu_utilization")
                && text.contains("nv_energy_consumption{gpu_uuid=\"GPU-0fake\"} 100")
            {
                break text;
            }
        };
        stop.cancel();
        task.await.unwrap();
        for line in [
            "nv_gpu_utilization{gpu_uuid=\"GPU-0fake\"} 0.75",
            "nv_gpu_memory_total_bytes{gpu_uuid=\"GPU-0fake\"} 80000000000",
            "nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-0fake\"} 2000000000",
            "nv_gpu_power_usage{gpu_uuid=\"GPU-0fake\"} 300",
            "nv_gpu_power_limit{gpu_uuid=\"GPU-0fake\"} 700",
            "# TYPE nv_energy_consumption counter",
            "nv_cpu_memory_total_bytes ",
            "nv_cpu_memory_used_bytes ",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
    }
}
