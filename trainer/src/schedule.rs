//! The learning-rate schedule, as the seeds' `train.py` shapes it: linear warm-up, a
//! plateau at the peak, then a decay (cosine, linear or none) that reaches `min_lr` at
//! `decay_steps` and stays there.

use crate::args::{Args, DecayStyle};

#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub plateau_steps: u64,
    /// The step where the decay ends.
    pub decay_steps: u64,
    pub style: DecayStyle,
}

/// A fraction of `of` when below 1, else a number of steps.
fn steps(value: f64, of: u64) -> u64 {
    if value < 1.0 {
        (value * of as f64).ceil() as u64
    } else {
        value as u64
    }
}

impl Schedule {
    pub fn from_args(a: &Args) -> Self {
        let decay_steps = a.lr_decay_iters.unwrap_or(a.steps());
        Self {
            lr: a.lr,
            min_lr: a.min_lr.unwrap_or(a.lr / 10.0),
            warmup_steps: steps(a.warmup, decay_steps),
            plateau_steps: steps(a.plateau, decay_steps),
            decay_steps,
            style: a.lr_decay_style,
        }
    }

    /// The rate for step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay_from = self.warmup_steps + self.plateau_steps;
        if step < decay_from {
            return self.lr;
        }
        let span = self.decay_steps.saturating_sub(decay_from).max(1) as f64;
        let progress = ((step - decay_from) as f64 / span).min(1.0);
        let fall = self.lr - self.min_lr;
        match self.style {
            DecayStyle::Constant => self.lr,
            DecayStyle::Linear => self.min_lr + fall * (1.0 - progress),
            // Refused by `Args::validate`; cosine if it ever gets here.
            DecayStyle::Cosine | DecayStyle::Exponential => {
                self.min_lr + 0.5 * fall * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn schedule(flags: &[&str]) -> Schedule {
        let args = Args::try_parse_from([&["fsdp-trainer"], flags].concat()).unwrap();
        Schedule::from_args(&args)
    }

    #[test]
    fn warms_up_linearly_then_decays_to_the_floor() {
        let s = schedule(&["--lr=1", "--min_lr=0.1", "--warmup=0.1", "--max_steps=100"]);
        assert_eq!(s.warmup_steps, 10);
        assert!((s.at(0) - 0.1).abs() < 1e-12);
        assert!((s.at(9) - 1.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!(s.at(50) < 1.0 && s.at(50) > 0.1);
        assert!((s.at(100) - 0.1).abs() < 1e-12);
        assert_eq!(schedule(&["--warmup=5"]).warmup_steps, 5);
    }

    #[test]
    fn a_plateau_holds_the_peak_and_linear_decay_falls_evenly() {
        let s = schedule(&[
            "--lr=1",
            "--min_lr=0",
            "--warmup=10",
            "--plateau=0.2",
            "--lr_decay_style=linear",
            "--max_steps=100",
        ]);
        assert_eq!(s.plateau_steps, 20);
        assert!((s.at(29) - 1.0).abs() < 1e-12, "{}", s.at(29));
        // 70 steps of decay from step 30: halfway at 65.
        assert!((s.at(65) - 0.5).abs() < 1e-12, "{}", s.at(65));
        assert!(s.at(100).abs() < 1e-12);
    }

    #[test]
    fn the_decay_ends_at_lr_decay_iters_and_stays_at_the_floor() {
        let s = schedule(&[
            "--lr=1",
            "--min_lr=0.5",
            "--lr_decay_iters=50",
            "--max_steps=100",
        ]);
        assert!((s.at(50) - 0.5).abs() < 1e-12);
        assert!((s.at(99) - 0.5).abs() < 1e-12);
        let c = schedule(&["--lr=1", "--lr_decay_style=constant", "--warmup=2"]);
        assert!((c.at(1) - 1.0).abs() < 1e-12 && (c.at(90) - 1.0).abs() < 1e-12);
    }
}
