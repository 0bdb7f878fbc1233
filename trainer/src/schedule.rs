//! The learning-rate schedule: linear warm-up, then cosine decay to `min_lr`.

#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub max_steps: u64,
}

impl Schedule {
    pub fn new(lr: f64, min_lr: Option<f64>, warmup: f64, max_steps: u64) -> Self {
        let warmup_steps = if warmup < 1.0 {
            (warmup * max_steps as f64).ceil() as u64
        } else {
            warmup as u64
        };
        Self {
            lr,
            min_lr: min_lr.unwrap_or(lr / 10.0),
            warmup_steps,
            max_steps,
        }
    }

    /// The rate for step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.max_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        self.min_lr
            + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_linearly_then_decays_to_the_floor() {
        let s = Schedule::new(1.0, Some(0.1), 0.1, 100);
        assert_eq!(s.warmup_steps, 10);
        assert!((s.at(0) - 0.1).abs() < 1e-12);
        assert!((s.at(9) - 1.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!(s.at(50) < 1.0 && s.at(50) > 0.1);
        assert!((s.at(100) - 0.1).abs() < 1e-12);
        assert_eq!(Schedule::new(1.0, None, 5.0, 100).warmup_steps, 5);
    }
}
